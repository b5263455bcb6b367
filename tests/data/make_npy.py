#!/usr/bin/python3
"""Write the .npy files tests/unit/data_test.cpp reads with paratrain::data::NpyDataset.

NumPy writes them, so the reader is checked against NumPy's format, not against a writer
of its own. Every value is a formula of its position, which the test computes again:

    npy_x.npy     float32 [11, 3, 2]   x[i, j, k] = i * 100 + j * 10 + k      (format 1.0)
    npy_y.npy     int64   [11]         y[i] = (i * 7) % 5
    npy_u8_v2.npy uint8   [11, 4]      u[i, j] = (i * 4 + j) % 256            (format 2.0)
    npy_be.npy    >f4     [11]         big-endian: rejected, naming the fix
    npy_fortran.npy float64 [11, 3]    Fortran-ordered: rejected
    npy_short.npy float32 [11, 3]      the last 8 bytes cut off: rejected
    npy_y10.npy   int64   [10]         one sample fewer than npy_x: rejected as a pair

Rerun from the repository root: /usr/bin/python3 tests/data/make_npy.py
"""

import pathlib

import numpy as np

here = pathlib.Path(__file__).parent
n = 11
i, j, k = np.meshgrid(np.arange(n), np.arange(3), np.arange(2), indexing="ij")
np.save(here / "npy_x.npy", (i * 100 + j * 10 + k).astype("<f4"))
np.save(here / "npy_y.npy", ((np.arange(n) * 7) % 5).astype("<i8"))
with open(here / "npy_u8_v2.npy", "wb") as f:
    np.lib.format.write_array(f, (np.arange(n * 4).reshape(n, 4) % 256).astype("u1"), version=(2, 0))
np.save(here / "npy_be.npy", np.arange(n, dtype=">f4"))
np.save(here / "npy_fortran.npy", np.asfortranarray(np.arange(n * 3, dtype="<f8").reshape(n, 3)))
np.save(here / "npy_short.npy", np.zeros((n, 3), dtype="<f4"))
with open(here / "npy_short.npy", "r+b") as f:
    f.truncate(f.seek(0, 2) - 8)
np.save(here / "npy_y10.npy", np.arange(10, dtype="<i8"))
