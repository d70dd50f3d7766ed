"""The client role: check, submit or attach, local nodes, watch, report, final params.

Owns ``train_distribution``; must never spin without telling the user what it waits for.
"""
