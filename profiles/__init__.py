"""The bundled GPU profiles: TOML data, installed as the package ``autotune.profiles``
(pyproject.toml maps this top-level folder there); ``autotune.gpus.catalog`` reads them."""
