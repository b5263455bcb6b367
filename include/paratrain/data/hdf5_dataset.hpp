#pragma once
/// \file
/// Moved: this header is now <paratrain/data/hdf5/hdf5_dataset.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/data/hdf5/hdf5_dataset.hpp

#include "paratrain/data/hdf5/hdf5_dataset.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/data/hdf5_dataset.hpp> moved to <paratrain/data/hdf5/hdf5_dataset.hpp>; the old path goes in the next release")
#endif
