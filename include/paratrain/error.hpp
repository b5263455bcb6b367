#pragma once
/// \file
/// Moved: this header is now <paratrain/core/error.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/core/error.hpp

#include "paratrain/core/error.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/error.hpp> moved to <paratrain/core/error.hpp>; the old path goes in the next release")
#endif
