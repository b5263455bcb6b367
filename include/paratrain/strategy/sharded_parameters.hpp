#pragma once
/// \file
/// Moved: this header is now <paratrain/strategy/stores/sharded_parameters.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/strategy/stores/sharded_parameters.hpp

#include "paratrain/strategy/stores/sharded_parameters.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/sharded_parameters.hpp> moved to <paratrain/strategy/stores/sharded_parameters.hpp>; the old path goes in the next release")
#endif
