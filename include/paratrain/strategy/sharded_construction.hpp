#pragma once
/// \file
/// Moved: this header is now <paratrain/strategy/stores/sharded_construction.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/strategy/stores/sharded_construction.hpp

#include "paratrain/strategy/stores/sharded_construction.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/sharded_construction.hpp> moved to <paratrain/strategy/stores/sharded_construction.hpp>; the old path goes in the next release")
#endif
