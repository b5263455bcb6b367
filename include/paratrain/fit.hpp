#pragma once
/// \file
/// Moved: this header is now <paratrain/fit/fit.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/fit/fit.hpp

#include "paratrain/fit/fit.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/fit.hpp> moved to <paratrain/fit/fit.hpp>; the old path goes in the next release")
#endif
