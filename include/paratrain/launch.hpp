#pragma once
/// \file
/// Moved: this header is now <paratrain/comm/launch.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/comm/launch.hpp

#include "paratrain/comm/launch.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/launch.hpp> moved to <paratrain/comm/launch.hpp>; the old path goes in the next release")
#endif
