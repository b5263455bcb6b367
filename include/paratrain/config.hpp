#pragma once
/// \file
/// Moved: this header is now <paratrain/core/config.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/core/config.hpp

#include "paratrain/core/config.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/config.hpp> moved to <paratrain/core/config.hpp>; the old path goes in the next release")
#endif
