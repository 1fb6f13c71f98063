"""The workspace oneDNN's LSTM keeps for backward on a real CPU, from the shapes of the call.

On a CPU torch runs ``nn.LSTM`` (fp32, and bf16 where the CPU has oneDNN's bf16 primitives; without projections or
packed sequences) through ``mkldnn_rnn_layer``, one call per layer and direction, its input laid out as (steps,
batch, features) whatever ``batch_first`` says (aten/src/ATen/native/mkldnn/RNN.cpp). With grad mode on, the call
asks oneDNN for a training primitive and allocates the workspace that primitive describes: a uint8 tensor that
autograd keeps for ``mkldnn_rnn_layer_backward``, holding every step's gates and the states around them, most of an
LSTM's activations (32,845,824 B for 64 steps of a batch of 32, 128 inputs and 256 hidden units, where the layer's
output is 2,097,152 B). torch's meta kernel returns it empty, and so a simulation on fake CPU tensors missed it.

Its size is oneDNN's own layout (``set_workspace_sizes`` in src/cpu/rnn/rnn_utils.hpp and ``set_offsets`` in
src/cpu/rnn/rnn_utils.cpp; torch 2.13 bundles oneDNN 3.12). For one layer and one direction, over T steps of a batch
of B, I inputs and H hidden units, seven regions: the gates (T x B x 4H), the hidden states written per step
(T x B x H), the layer's states (T + 1 steps of 2 layers, of the wider of I and H; the iteration's states share that
region), the cell states (T + 1 steps of 2 layers of H), and backward's differences of the layer's, the iteration's
and the cell's states (the same counts, in fp32). Each region starts on a 4,096-byte page, and the empty region
after them rounds the total up to one. A row of the gates, the hidden states and the layer's states (and their
differences) is padded to 64 bytes, then by 64 bytes more where it comes to a multiple of 256 elements (oneDNN's
``get_good_ld``: aligned rows, off the 4K aliasing stride); the cell states' rows are not. The gates and the states
are in the input's dtype, the cell states in ``cx``'s, the differences in fp32.

Checked against the real kernel on this project's machines: 40 random shapes in fp32 and 30 in bf16, equal to the
byte (bf16's gates are bf16). A 16-bit dtype other than bf16 is given fp32 gates, the larger of the two layouts
oneDNN could take: never under the real workspace. The layout does not depend on the CPU's instruction set: the
row padding is chosen by element size alone.
"""

from __future__ import annotations

import torch

__all__ = ["lstm_workspace_bytes", "PAGE"]

#: oneDNN's page, to which each region of an RNN workspace is aligned (``set_offsets``).
PAGE = 4096
#: The bytes a row of the padded regions is aligned to.
_LINE = 64
#: An LSTM's gates per hidden unit (input, forget, cell, output).
_GATES = 4
_FP32 = 4


def _row(elements: int, item: int) -> int:
    """The elements of a padded row holding ``elements`` of ``item`` bytes (oneDNN's ``get_good_ld``)."""
    per_line = _LINE // item
    row = -(-elements // per_line) * per_line
    return row + per_line if row % 256 == 0 else row


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def lstm_workspace_bytes(steps: int, batch: int, inputs: int, hidden: int, dtype: torch.dtype,
                         cell_dtype: torch.dtype) -> int:
    """The bytes of the workspace oneDNN allocates for one LSTM layer and direction in training: ``steps`` steps of
    a batch of ``batch``, ``inputs`` input features, ``hidden`` units, the input in ``dtype`` and the cell state in
    ``cell_dtype``."""
    state = dtype.itemsize
    gates = state if dtype in (torch.float32, torch.bfloat16) else _FP32
    wide = max(inputs, hidden)
    kept = 2 * (steps + 1) * batch  # the states of the layer's input and output, one more step than computed
    regions = (
        steps * batch * _row(_GATES * hidden, gates) * gates,
        steps * batch * _row(hidden, state) * state,
        kept * _row(wide, state) * state,
        kept * hidden * cell_dtype.itemsize,
        kept * _row(wide, _FP32) * _FP32,
        kept * _row(wide, _FP32) * _FP32,
        kept * hidden * _FP32,
    )
    offset = 0
    for size in regions:
        offset = _page_up(offset) + size
    return _page_up(offset)
