#pragma once
/// \file
/// Moved: this header is now <paratrain/core/timeline.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/core/timeline.hpp

#include "paratrain/core/timeline.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/observe/timeline.hpp> moved to <paratrain/core/timeline.hpp>; the old path goes in the next release")
#endif
