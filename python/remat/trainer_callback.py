"""remat.patch inside a Hugging Face Trainer run, after ``accelerator.prepare``: what DeepSpeed's
sequence parallelism through HF Accelerate needs.

With ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", ...))`` the
Trainer's ``prepare`` registers DeepSpeed's Ulysses attention wrapper for the model's attention
implementation (Accelerate allows "sdpa" and the flash-attention kernels) and DeepSpeed refuses a
model whose config names another one; a patched model's says ``"remat"`` (remat.replacement). So
the model is patched after ``prepare``, when training begins: :func:`patch_callback`. remat's fused
layers then never call the registered wrapper; they run their own Ulysses all-to-alls over
DeepSpeed's group (``sequence_parallel="deepspeed"``, remat.sequence_parallel.SequenceGroup), and the
Trainer's own loss under sequence parallelism (transformers' ``deepspeed_sp_compute_loss``) runs on
remat's fused loss.
"""


def patch_callback(**patch_arguments):
    """A ``transformers.TrainerCallback`` that calls ``remat.patch(model, **patch_arguments)`` once,
    at ``on_train_begin`` (after the Trainer's ``accelerator.prepare``), on the Trainer's model;
    the :class:`remat.PatchReport` is then the callback's ``report``. Patching shares every
    parameter, so the optimizer ``prepare`` built keeps training them. Use it for
    ``sequence_parallel="deepspeed"`` under HF Accelerate's DeepSpeed sequence parallelism; a model
    without it is patched before the Trainer is built, as usual.

    Example: ``Trainer(model, args, callbacks=[remat.patch_callback(policy="memory",
    sequence_parallel="deepspeed")])``.
    """
    from transformers import TrainerCallback

    from remat.patch import patch

    class RematPatchCallback(TrainerCallback):
        report = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self.report is None:
                if model is None:
                    raise ValueError("remat.patch_callback: the Trainer passed no model to on_train_begin")
                self.report = patch(model, **patch_arguments)

    return RematPatchCallback()
