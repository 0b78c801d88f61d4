"""Debug only (not part of the project): run tasks.train_worker as one of N torchrun ranks that all share cuda:0,
DDP over gloo (NCCL refuses two ranks on one device). Reproduces the multi-rank GPU path on a 1-GPU machine."""
import os
import runpy
import sys

os.environ["LOCAL_RANK"] = "0"
sys.path.insert(0, os.getcwd())
import transformers  # noqa: E402

_post = transformers.TrainingArguments.__post_init__


def _gloo(self):
    self.ddp_backend = "gloo"
    _post(self)


transformers.TrainingArguments.__post_init__ = _gloo
runpy.run_module("tasks.train_worker", run_name="__main__", alter_sys=True)
