"""What every node shares: serve() (wait for a task, claim a lease, run), the lease kept, retries, stats.

Owns the rules for a lost lease, a board away and a task ended; must never know a role.
"""
