#pragma once
/// \file
/// Moved: this header is now <paratrain/core/reduce_op.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/core/reduce_op.hpp

#include "paratrain/core/reduce_op.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/comm/reduce_op.hpp> moved to <paratrain/core/reduce_op.hpp>; the old path goes in the next release")
#endif
