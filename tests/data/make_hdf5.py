#!/usr/bin/python3
"""Write the small HDF5 files tests/unit/hdf5_test.cpp reads (tests/data/hdf5_*.h5).

Every value is a formula of the sample index i, which the C++ test computes again on
its own, so the reader is checked against the formula and never against itself:

    x[i, j, k]  = i * 100 + j * 10 + k        float32 [N, 3, 4]
    code[i, j]  = (i * 37 + j) % 256          uint8   [N, 2]
    labels/y[i] = i * 10**10 + 1              int64   [N]  (beyond 32 bits)
    flag[i]     = i % 3 == 0                  h5py's bool (an enum over int8)
    compact[i]  = -i                          int16   [N], compact layout
    unwritten   = 7.5 everywhere              float32 [N, 2], storage never allocated

Files (N = 24; about 41 KB together):

    hdf5_contiguous.h5  the datasets above, contiguous (h5py's default), plus datasets
                        the reader must reject: text (strings), u16 (uint16), scalar
                        (no dimension 0), short (N - 1 samples)
    hdf5_chunked.h5     x, code, labels/y and flag in chunks of 5 samples, gzip and
                        shuffle: HDF5 reads them, under the lock
    hdf5_big_endian.h5  x as big-endian float32 and labels/y as big-endian int64,
                        contiguous; x_chunked, big-endian float32 in chunks
    hdf5_userblock.h5   x and labels/y, contiguous, after a 512-byte user block: the
                        offset HDF5 reports must be counted from the file's start

Rerun from the repository root (Debian: python3-h5py):

    /usr/bin/python3 tests/data/make_hdf5.py

Timestamps are off (track_times=False), so a rerun with the same h5py writes the same
bytes.
"""

import pathlib

import h5py
import numpy as np

N = 24
HERE = pathlib.Path(__file__).resolve().parent


def x_values(n=N):
    i, j, k = np.meshgrid(np.arange(n), np.arange(3), np.arange(4), indexing="ij")
    return (i * 100 + j * 10 + k).astype(np.float32)


def code_values(n=N):
    i, j = np.meshgrid(np.arange(n), np.arange(2), indexing="ij")
    return ((i * 37 + j) % 256).astype(np.uint8)


def y_values(n=N):
    return np.arange(n, dtype=np.int64) * 10**10 + 1


def flag_values(n=N):
    return np.arange(n) % 3 == 0


def new_file(name, **kwargs):
    return h5py.File(HERE / name, "w", **kwargs)


def compact_dataset(f, name, data):
    """h5py has no keyword for the compact layout: the low-level API makes one."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    dcpl.set_obj_track_times(False)
    space = h5py.h5s.create_simple(data.shape)
    dset = h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(data.dtype), space, dcpl=dcpl)
    dset.write(h5py.h5s.ALL, h5py.h5s.ALL, data)


def write_contiguous():
    with new_file("hdf5_contiguous.h5") as f:
        f.create_dataset("x", data=x_values(), track_times=False)
        f.create_dataset("code", data=code_values(), track_times=False)
        f.create_group("labels").create_dataset("y", data=y_values(), track_times=False)
        f.create_dataset("flag", data=flag_values(), track_times=False)
        compact_dataset(f, "compact", -np.arange(N, dtype=np.int16))
        f.create_dataset("unwritten", shape=(N, 2), dtype=np.float32, fillvalue=7.5, track_times=False)
        f.create_dataset("text", data=[f"sample {i}" for i in range(N)], dtype=h5py.string_dtype(),
                         track_times=False)
        f.create_dataset("u16", data=np.arange(N, dtype=np.uint16), track_times=False)
        f.create_dataset("scalar", data=np.float32(1), track_times=False)
        f.create_dataset("short", data=y_values(N - 1), track_times=False)
        assert f["unwritten"].id.get_storage_size() == 0, "h5py allocated the unwritten dataset"
        assert f["compact"].id.get_create_plist().get_layout() == h5py.h5d.COMPACT


def write_chunked():
    with new_file("hdf5_chunked.h5") as f:
        opts = dict(chunks=True, compression="gzip", shuffle=True, track_times=False)
        f.create_dataset("x", data=x_values(), **{**opts, "chunks": (5, 3, 4)})
        f.create_dataset("code", data=code_values(), **{**opts, "chunks": (5, 2)})
        f.create_group("labels").create_dataset("y", data=y_values(), **{**opts, "chunks": (5,)})
        f.create_dataset("flag", data=flag_values(), **{**opts, "chunks": (5,)})


def write_big_endian():
    with new_file("hdf5_big_endian.h5") as f:
        f.create_dataset("x", data=x_values().astype(">f4"), track_times=False)
        f.create_group("labels").create_dataset("y", data=y_values().astype(">i8"), track_times=False)
        f.create_dataset("x_chunked", data=x_values().astype(">f4"), chunks=(5, 3, 4), track_times=False)
        assert f["x"].dtype == np.dtype(">f4") and f["labels/y"].dtype == np.dtype(">i8")


def write_userblock():
    with new_file("hdf5_userblock.h5", userblock_size=512) as f:
        f.create_dataset("x", data=x_values(), track_times=False)
        f.create_group("labels").create_dataset("y", data=y_values(), track_times=False)


if __name__ == "__main__":
    write_contiguous()
    write_chunked()
    write_big_endian()
    write_userblock()
    for path in sorted(HERE.glob("hdf5_*.h5")):
        print(f"{path.name}: {path.stat().st_size} bytes")
