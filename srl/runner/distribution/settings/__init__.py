"""The task as data and what a node is told: node options, connection parameters, credentials.

Owns what every role reads before it runs; must never touch a broker or the board.
"""
