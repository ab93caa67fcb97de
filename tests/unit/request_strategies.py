"""Hypothesis strategies for Triton model requests: any input, any dtype, any shape, any value.

Used by the request parser's property test (tests/unit/serving) and by the real-tritonserver
sample (tests/integration/test_triton_serving.py).
"""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import strategies as st

NAMES = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed",
         "stop_words", "num_draft_tokens")
TEXTS = st.one_of(st.binary(max_size=12), st.text(max_size=12).map(str.encode),
                  st.text(max_size=12), st.sampled_from([b"", b" ", b"\x00", b"\xff\xfe", b"hi"]))
NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.integers(0, 40))
DTYPES = [np.int8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64, np.bool_]


@st.composite
def arrays(draw, shapes=((), (1,), (2,), (0,), (1, 1), (3,)), text=True):
    """One input tensor: an object array of text (when `text`) or numbers of any dtype."""
    shape = draw(st.sampled_from(shapes))
    size = int(np.prod(shape)) if shape else 1
    if text and draw(st.booleans()):
        values = draw(st.lists(TEXTS, min_size=size, max_size=size))
        array = np.empty(size, dtype=object)
        array[:] = values
        return array.reshape(shape)
    dtype = draw(st.sampled_from(DTYPES))
    values = draw(st.lists(NUMBERS, min_size=size, max_size=size))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # out-of-range casts wrap: any value will do
        try:
            return np.array(values, dtype=object).astype(dtype).reshape(shape)
        except (OverflowError, ValueError, TypeError):
            return np.zeros(shape, dtype=dtype)


@st.composite
def requests(draw, **array_options):
    """A dict of some of the model's inputs, each an arbitrary tensor."""
    return {name: draw(arrays(**array_options)) for name in NAMES if draw(st.booleans())}
