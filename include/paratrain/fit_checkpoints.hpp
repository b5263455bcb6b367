#pragma once
/// \file
/// Moved: this header is now <paratrain/fit/checkpoints.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/fit/checkpoints.hpp

#include "paratrain/fit/checkpoints.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/fit_checkpoints.hpp> moved to <paratrain/fit/checkpoints.hpp>; the old path goes in the next release")
#endif
