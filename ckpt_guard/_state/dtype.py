"""Reader: the default dtype (CKG105): a recompute under another default makes other tensors."""

from __future__ import annotations

import torch


# --------------------------------------------------------------------------
# default dtype

default_dtype = torch.get_default_dtype


def describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype)
