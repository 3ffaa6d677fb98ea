"""dsv41: a trainable and servable PyTorch implementation of DeepSeek-V4.1-Flash."""

from dsv41.config import ConfigError, ModelConfig, load_config

__all__ = ["ConfigError", "ModelConfig", "load_config"]
__version__ = "0.1.0"
