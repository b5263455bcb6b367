#pragma once
/// \file
/// Moved: this header is now <paratrain/strategy/stores/parameter_store.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/strategy/stores/parameter_store.hpp

#include "paratrain/strategy/stores/parameter_store.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/parameter_store.hpp> moved to <paratrain/strategy/stores/parameter_store.hpp>; the old path goes in the next release")
#endif
