"""Plans applied to other trainers: ``autotune.integrations.transformers`` (HF Trainer) and
``autotune.integrations.lightning``. Each module imports its library; this package imports none."""
