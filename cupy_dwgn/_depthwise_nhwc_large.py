"""Channels-last (NHWC) large-filter depthwise convolution by way of the NCHW
large-filter kernels: the call's NHWC arrays are transposed into NCHW
workspace (kernels/layout_transpose.cu), the NCHW kernel runs there
(_depthwise_nchw_large for forward and backward-input, the large weight
gradient of _depthwise_nchw_wgrad), and the result is transposed back.

Why: a large filter reads each input value K*K times, so the work is in the
taps, not the bytes; the NCHW kernels keep a plane in shared memory and skip
taps in the padding, while the NHWC kernels stream channel vectors with
every tap from shared memory; the two transposes move 2 x (input + output)
bytes.

Rule, measured on an H200 (2026-12-01, ``benchmarks/depthwise_nhwc_large.py``,
GPU time per call, us, NHWC kernels / this path):

* forward and backward-input: every call the NCHW large kernel serves
  (MIN_TAPS taps and more, stride 1, dilation 1).  Faster in all 28
  measured cells, 1.04x to 7.8x: 16x512x16x16 31x31 float16 forward 615 /
  79, float32 284 / 80; 64x128x56x56 13x13 float16 1593 / 589; the
  smallest gain 64x384x14x14 9x9 float32 (111 / 106).
* weight gradient: float32 and float64 from 13x13 (64x128x56x56 3057 /
  2097, 16x1024x8x8 224 / 122; 9x9 lost: 64x96x56x56 1341 / 1655), half
  types from 31x31 (16x512x16x16 522 / 267, 32x256x32x32 2527 / 998; 13x13
  lost: 64x128x56x56 1539 / 2070, and 9x9).

Cost: workspace for the NCHW copies of the input and the output (the weight
gradient: of grad_out and x).
"""

import functools

import numpy

from . import _compile, _depthwise_nchw_large, _depthwise_nchw_wgrad, _dtypes, _launch
from ._launch import i32

KERNEL_FILE = "layout_transpose.cu"
KERNEL = "dwgn_transpose"
#: The unsigned word the transpose moves, per element size.
WORDS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
#: The ops take this path where it serves the call; False: never
#: (benchmarks/depthwise_nhwc_large.py times both).
ENABLED = True
TILE = 32  # kernel: kTile
ROWS_PER_PASS = 8  # kernel: kRowsPerPass
_MAX_GRID = 2**20


def _expression(itemsize, index):
    return _compile.name_expression(KERNEL, WORDS[itemsize], index)


def specializations(dtypes=None, large_index=(False, True), weight_gradient=False):
    """``(file, name expression)`` of every kernel this path launches: the
    transposes (one per element size and index width) and the NCHW large
    kernels (forward and backward-input, or with ``weight_gradient`` the
    large weight-gradient kernel and its finalize)."""
    dtypes = list(_dtypes.CTYPES) if dtypes is None else [numpy.dtype(d) for d in dtypes]
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    sizes = sorted({d.itemsize for d in dtypes})
    specs = [(KERNEL_FILE, _expression(size, "long long" if large else "int")) for size in sizes for large in large_index]
    if weight_gradient:
        specs += [spec for spec in _depthwise_nchw_wgrad.specializations(dtypes, None, large_index)
                  if not spec[1].startswith(_depthwise_nchw_wgrad.SMALL)]
    else:
        specs += _depthwise_nchw_large.specializations(dtypes, large_index)
    return specs


@functools.lru_cache(maxsize=1024)
def transpose(batch, rows, cols, itemsize):
    """The Launch (arguments: src, dst) that writes ``dst[b][c][r] =
    src[b][r][c]`` for a (batch, rows, cols) source."""
    tiles_r, tiles_c = -(-rows // TILE), -(-cols // TILE)
    tiles = batch * tiles_r * tiles_c
    index = _launch.index_type(batch * rows * cols)
    return _launch.Launch(
        KERNEL_FILE, _expression(itemsize, index), (max(1, min(tiles, _MAX_GRID)),), (TILE, ROWS_PER_PASS),
        0, (i32(rows), i32(cols), i32(tiles_r), i32(tiles_c), numpy.int64(tiles)),
    )


def forward_steps(g, dtype, backward):
    """``(launches with their argument positions, temporaries)`` for a
    Steps (call addresses: src, weight, bias or NULL, dst; the temporaries,
    the NCHW source and destination, follow as 4 and 5), or None when the
    NCHW large kernel does not serve ``g``."""
    launch = _depthwise_nchw_large.plan(g, dtype, backward) if ENABLED else None
    if launch is None:
        return None
    itemsize = numpy.dtype(dtype).itemsize
    out_channels = g.channels * g.multiplier
    src = (g.batch, out_channels, g.out_height, g.out_width) if backward else (g.batch, g.channels, g.height, g.width)
    dst = (g.batch, g.channels, g.height, g.width) if backward else (g.batch, out_channels, g.out_height, g.out_width)
    # NHWC source (N, H*W, C) -> NCHW (N, C, H*W); NCHW destination -> NHWC.
    to_nchw = transpose(src[0], src[2] * src[3], src[1], itemsize)
    to_nhwc = transpose(dst[0], dst[1], dst[2] * dst[3], itemsize)
    launches = ((to_nchw, (0, 4)), (launch, (4, 1, 2, 5)), (to_nhwc, (5, 3)))
    return launches, ((src, numpy.dtype(dtype)), (dst, numpy.dtype(dtype)))


#: Smallest filter (taps) whose weight gradient takes this path, per element
#: size (module docstring).
WEIGHT_GRADIENT_MIN_TAPS = {2: 31 * 31, 4: 13 * 13, 8: 13 * 13}


def backward_weight_steps(g, dtype, min_taps=None):
    """As :func:`forward_steps` for the weight gradient (call addresses:
    grad_out, x, NULL, grad_weight; temporaries: NCHW grad_out 4, NCHW x 5,
    and the partial sums 6 when the NCHW kernel splits the sum), or None when
    the NCHW large weight-gradient kernel does not serve ``g`` or the filter
    has fewer than ``min_taps`` taps (default: WEIGHT_GRADIENT_MIN_TAPS, the
    rule; the benchmark passes 0)."""
    taps = g.filter_height * g.filter_width
    if min_taps is None:
        min_taps = WEIGHT_GRADIENT_MIN_TAPS[numpy.dtype(dtype).itemsize]
    if not ENABLED or taps < min_taps:
        return None
    launches = _depthwise_nchw_wgrad.plan(g, dtype)
    if launches is None or not launches[0].expression.startswith(_depthwise_nchw_wgrad.LARGE):
        return None
    dtype = numpy.dtype(dtype)
    out_channels = g.channels * g.multiplier
    grad_out = (g.batch, out_channels, g.out_height, g.out_width)
    x = (g.batch, g.channels, g.height, g.width)
    steps = [
        (transpose(g.batch, g.out_height * g.out_width, out_channels, dtype.itemsize), (0, 4)),
        (transpose(g.batch, g.height * g.width, g.channels, dtype.itemsize), (1, 5)),
    ]
    temporaries = [(grad_out, dtype), (x, dtype)]
    if len(launches) == 1:  # one pass: no partial sums
        steps.append((launches[0], (4, 5, 2, 3)))
    else:
        partial, finalize = launches
        temporaries.append(((out_channels, partial.grid[1], g.filter_height * g.filter_width),
                            _dtypes.accumulator_dtype(dtype)))
        steps += [(partial, (4, 5, 6, 3)), (finalize, (6, 3))]
    return tuple(steps), tuple(temporaries)
