"""Chaos: real fault injection and scenario runs whose invariants prove nothing was lost.

May import anything; nothing imports ``chaos`` except tests and the CLI.

Not implemented yet: tracked by the chaos issue.
"""
