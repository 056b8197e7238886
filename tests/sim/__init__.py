"""Deterministic simulation of the commit protocol (the FoundationDB habit).

Actors (writers, snapshotters, garbage collectors, readers) run in threads under one baton;
every blob store call is a yield point where a seeded scheduler picks who runs next and may
inject a crash or a storage error. A model of the store checks ARCHITECTURE §5 after every
step. ``python -m tests.sim --scenario NAME --seed N`` replays one run; ``make soak`` runs many.
See ``scheduler.py`` for how determinism is kept, ``policy.py`` for the protocol assumptions
the commit-protocol redesign changes, ``scenarios.py`` for what runs.
"""
