"""A sharded checkpoint as the whole model's weights, written by one process
a file at a time: what reads a model whole (HF ``from_pretrained``, an
inference server) from a model that no rank could hold whole.

::

    python -m gradsync.torch.export ckpt/step-1000 exported/ [--max-shard-mb 5000] [--format safetensors|torch]

    from gradsync.torch.export import export
    export("ckpt/step-1000", "exported/")            # one process, no process group
    model.config.save_pretrained("exported/")         # (an HF model: its config beside the weights)

It reads the model entries of a checkpoint that ``gradsync.torch.checkpoint.save``
wrote (on any world size, its parameters sharded or not), a group of
entries at a time, each group no bigger than ``max_shard_bytes`` (one
larger entry is a group of its own), and writes each group to a file as
HF names them: ``model.safetensors`` alone, or ``model-00001-of-0000N.safetensors``
with ``model.safetensors.index.json`` (``format="torch"``:
``pytorch_model*.bin``, torch's pickles). So the process holds one file's
tensors at a time, plus what DCP reads of one saved block: never the whole
model, when the files are smaller than it. Keys, shapes and dtypes are the
module's ``state_dict()``'s (a complex parameter as its real view, as the
checkpoint holds it); tied weights are written under each of their names.
Entries of the checkpoint that are not tensors (a module's extra state)
are not exported; :func:`export` names them.
"""

import argparse
import json
import logging
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gradsync._errors import CheckpointError, ConfigError

log = logging.getLogger("gradsync")

#: HF's file names for each format: one file, a file of several, their index.
_NAMES = {
    "safetensors": ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"),
}


def _groups(entries, max_shard_bytes):
    """``entries`` (``[(key, metadata)]``, in order) cut into consecutive
    groups of at most ``max_shard_bytes`` each (an entry larger than that
    alone)."""
    groups, size = [[]], 0
    for key, meta in entries:
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, meta))
        size += nbytes
    return groups


def _writer(format):
    """The function that writes a dict of tensors to a path in ``format``."""
    if format == "torch":
        return torch.save
    if format != "safetensors":
        raise ConfigError(f"export format {format!r}: choose 'safetensors' or 'torch'")
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigError("exporting safetensors needs the safetensors package (pip install safetensors), "
                          "or export with format='torch'") from e
    return lambda tensors, path: save_file(tensors, path, metadata={"format": "pt"})


def export(checkpoint_id, directory, max_shard_bytes=5 * 10**9, format="safetensors"):
    """Write the model of ``checkpoint_id`` (a directory
    ``gradsync.torch.checkpoint.save`` wrote) to ``directory`` as whole
    tensors, in files of at most ``max_shard_bytes`` (see the module docs).
    One process, no process group. Returns the files written (an index
    last, when there are several) and the keys of the entries that are not
    tensors, which are not exported."""
    write = _writer(format)
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes}: give the most bytes a file may hold (> 0)")
    try:
        metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint_id} is not a readable checkpoint ({type(e).__name__}: {e}): give the "
                              "directory gradsync.torch.checkpoint.save wrote", []) from e
    model = [(fqn[len("model."):], meta) for fqn, meta in metadata.state_dict_metadata.items()
             if fqn.startswith("model.")]
    entries = [(key, meta) for key, meta in model if isinstance(meta, TensorStorageMetadata)]
    others = [key for key, meta in model if not isinstance(meta, TensorStorageMetadata)]
    if not entries:
        raise ConfigError(f"{checkpoint_id} holds no model tensors: write it with gradsync.torch.checkpoint.save")
    os.makedirs(directory, exist_ok=True)
    one, several, index = _NAMES[format]
    groups = _groups(entries, max_shard_bytes)
    files, weight_map, total = [], {}, 0
    for n, group in enumerate(groups, 1):
        state = {f"model.{key}": torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in group}
        with warnings.catch_warnings():  # (one process, no process group: what export is for)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint_id), no_dist=True)
        name = one if len(groups) == 1 else several.format(n, len(groups))
        tensors = {key: state[f"model.{key}"] for key, _ in group}
        write(tensors, os.path.join(directory, name))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        weight_map.update((key, name) for key in tensors)
        files.append(os.path.join(directory, name))
        log.info("gradsync export: %s written (%d of %d, %.1f MB)", name, n, len(groups), nbytes / 1e6)
        del state, tensors
    if len(groups) > 1:
        with open(os.path.join(directory, index), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(os.path.join(directory, index))
    return files, others


def main(argv=None):
    """``python -m gradsync.torch.export``: :func:`export` from the command line."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.torch.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="the directory gradsync.torch.checkpoint.save wrote")
    parser.add_argument("directory", help="where the whole model's files go")
    parser.add_argument("--max-shard-mb", type=float, default=5000, help="the most MB one file holds (default 5000)")
    parser.add_argument("--format", choices=sorted(_NAMES), default="safetensors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        files, others = export(args.checkpoint, args.directory, int(args.max_shard_mb * 1e6), args.format)
    except (ConfigError, CheckpointError) as e:
        sys.exit(f"gradsync export: {e}")
    if others:
        print(f"gradsync export: not exported (not tensors): {', '.join(others)}", file=sys.stderr)
    print(f"gradsync export: {len(files)} files in {args.directory}")


if __name__ == "__main__":
    main()
