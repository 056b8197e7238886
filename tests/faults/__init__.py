"""Randomized fault suites (issue 13): SIGKILL trials, corruption of every blob kind, S3
faults through a failing proxy. ``python -m tests.faults --seeds N`` runs them and prints a
table; ``test_faults_slice.py`` runs a few seeds of each under pytest."""
