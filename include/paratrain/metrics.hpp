#pragma once
/// \file
/// Moved: this header is now <paratrain/fit/metrics.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/fit/metrics.hpp

#include "paratrain/fit/metrics.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/metrics.hpp> moved to <paratrain/fit/metrics.hpp>; the old path goes in the next release")
#endif
