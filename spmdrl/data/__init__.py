"""Prompt data in verl's parquet schema, the SFT warm-start data, the sampler, and dataset converters."""
from spmdrl.data.prompts import PromptBatch, PromptDataset, left_pad
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.data.schema import validate_table
from spmdrl.data.sft import SFTBatch, SFTDataset

__all__ = [
    "DistributedPromptSampler",
    "PromptBatch",
    "PromptDataset",
    "SFTBatch",
    "SFTDataset",
    "left_pad",
    "validate_table",
]
