#pragma once
/// \file
/// Moved: this header is now <paratrain/core/batch.hpp> (Batch) and
/// <paratrain/data/tensor_dataset.hpp> (data::TensorDataset); this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/core/batch.hpp

#include "paratrain/core/batch.hpp"
#include "paratrain/data/tensor_dataset.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/data/batch.hpp> moved to <paratrain/core/batch.hpp> and <paratrain/data/tensor_dataset.hpp>; the old path goes in the next release")
#endif
