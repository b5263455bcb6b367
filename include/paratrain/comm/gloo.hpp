#pragma once
/// \file
/// Moved: this header is now <paratrain/comm/gloo/gloo.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/comm/gloo/gloo.hpp

#include "paratrain/comm/gloo/gloo.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/comm/gloo.hpp> moved to <paratrain/comm/gloo/gloo.hpp>; the old path goes in the next release")
#endif
