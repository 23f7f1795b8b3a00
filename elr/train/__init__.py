"""Training: the Trainer (trainer.py, whose public hooks a training stage overrides) and what one optimizer
update needs: data and token files, the loop sampler, the loss, the optimizer, validation at every k,
metrics and the step line, the checkpoint manager (checkpointer.py) and the initial weights of a later
stage, resume and run-folder rules, the run lock, non-finite handling and stragglers.

It imports every layer below it (config, text, models, parallel, checkpoint, interop), never
inference (elr.infer), which sits beside it; train.py and the scripts import it.
"""
