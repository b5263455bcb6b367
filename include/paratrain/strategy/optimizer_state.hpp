#pragma once
/// \file
/// Moved: this header is now <paratrain/concepts/optimizer_state.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/concepts/optimizer_state.hpp

#include "paratrain/concepts/optimizer_state.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/optimizer_state.hpp> moved to <paratrain/concepts/optimizer_state.hpp>; the old path goes in the next release")
#endif
