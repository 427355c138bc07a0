"""GPUs you may not have: datasheet profiles (``profiles/*.toml``) and planning for one.

- ``catalog``: read and check the profiles.
- ``target``: the budget and estimate-backed memory backend for a profile.
"""
