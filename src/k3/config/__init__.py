"""The model configuration (SPEC §0): the dataclass tree and its validation (`k3.config.schema`), the presets
(`k3.config.presets`) and Hugging Face / released ``config.json`` files (`k3.config.hf`). The public names of all
three are importable from here."""

from k3.config.schema import (
    MEDIA_TOKEN_ID,
    MX_ACTIVATION_FORMATS,
    MX_WEIGHT_FORMATS,
    PACKED_ACTIVATIONS,
    SIZE_LIMITS,
    AttnResConfig,
    K3Config,
    KDAConfig,
    MLAConfig,
    MoEConfig,
    MXConfig,
    SiTUConfig,
    VisionConfig,
    missing_fields,
)
from k3.config.presets import (
    ASSUMPTIONS,
    PRESETS,
    PUBLISHED_ACTIVE,
    PUBLISHED_TOTAL,
    PUBLISHED_VISION,
    RELEASE_DECISIONS,
    preset,
)
from k3.config.hf import load_config

__all__ = ["ASSUMPTIONS", "MEDIA_TOKEN_ID", "MX_ACTIVATION_FORMATS", "MX_WEIGHT_FORMATS", "PACKED_ACTIVATIONS",
           "PRESETS", "PUBLISHED_ACTIVE", "PUBLISHED_TOTAL", "PUBLISHED_VISION", "RELEASE_DECISIONS", "SIZE_LIMITS",
           "AttnResConfig", "K3Config", "KDAConfig", "MLAConfig", "MXConfig", "MoEConfig", "SiTUConfig", "VisionConfig",
           "load_config", "missing_fields", "preset"]
