"""Checkpoint I/O: Hugging Face safetensors directories in and out, one job per module.

| module       | job                                                                                     |
| ------------ | --------------------------------------------------------------------------------------- |
| ``files``    | which files make the checkpoint transformers loads from a directory; each opened once   |
| ``reader``   | this rank's slice of each tensor: a view of the file's mapping, or a copy, into a model  |
| ``keys``     | checkpoint keys against the model's names: renames, base-model prefix, ties, buffers     |
| ``save``     | the dense save: gather per file, a temporary directory, one atomic switch, cleanup       |

``files``, ``reader`` and ``keys`` are local: no collective, the same result or error on
every rank given the same directory. ``save`` gathers over the TP group, has several ranks write
the files, and reports every rank's outcome to every rank (:func:`tpify.agree.on_every_rank`,
:func:`tpify.agree.on_writing_rank`). Training checkpoints at any layout (torch.distributed.checkpoint)
are :mod:`tpify.checkpoint`. The sequences
that use them (``from_pretrained``, ``load_weights_``, ``save_pretrained``) are in
:mod:`tpify.api`, next to ``parallelize``.
"""


class CheckpointError(ValueError):
    """A checkpoint directory does not fit the model: missing, misshapen or unreadable tensors."""
