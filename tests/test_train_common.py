"""Training plumbing: a work directory refuses caches made from other weights."""

import pytest
import torch

from mmfast.train.common import bind_work_dir


def test_work_dir_is_bound_to_the_weights(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    bind_work_dir(tmp_path, model)
    bind_work_dir(tmp_path, model)  # same weights: resuming is fine
    with torch.no_grad():
        model.weight.add_(1.0)  # "retrained"
    with pytest.raises(RuntimeError, match="other model weights.*fresh --work"):
        bind_work_dir(tmp_path, model)
