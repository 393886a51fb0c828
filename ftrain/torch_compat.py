"""What differs between the torch releases ftrain runs on (``torch>=2.6``), in one place.

CI here runs torch 2.13; GPU hosts often run an older release (the lent H200 had 2.11). A name
that only the newest torch has breaks every step there, so code calls the names below instead.
"""

from __future__ import annotations

import torch.distributed as dist

#: gather equal-sized tensors from every rank into one (2.13 renamed ``all_gather_into_tensor``
#: to ``all_gather_single`` and warns on the old name; 2.11 has only the old one)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather_single"]
