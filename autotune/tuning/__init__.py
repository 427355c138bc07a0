"""Tuning for throughput: time real training windows and search configurations with Optuna.

- ``measure``: time one configuration, or several side by side.
- ``search``: the candidates, the Optuna study and the winner.
"""
