"""DeepSeek-V4.1 (`deepseek_v41`): config, numerics, Engram, CSA2 attention, MoE, DSpark, state, loader."""

from .config import V41Config, V41ConfigError
from .loader import V41CheckpointError, load_v41
from .model import DeepseekV41ForCausalLM, DSparkDraft, V41Output

__all__ = ["V41Config", "V41ConfigError", "V41CheckpointError", "load_v41", "DeepseekV41ForCausalLM",
           "DSparkDraft", "V41Output"]
