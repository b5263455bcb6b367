#pragma once
/// \file
/// Moved: this header is now <paratrain/comm/nccl/nccl.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/comm/nccl/nccl.hpp

#include "paratrain/comm/nccl/nccl.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/comm/nccl.hpp> moved to <paratrain/comm/nccl/nccl.hpp>; the old path goes in the next release")
#endif
