"""plait: exact, observable data/tensor/pipeline parallel training of transformer LMs."""

from plait.errors import CommError, CommTimeoutError, ConfigError

__version__ = "0.1.0"
__all__ = ["CommError", "CommTimeoutError", "ConfigError", "__version__"]
