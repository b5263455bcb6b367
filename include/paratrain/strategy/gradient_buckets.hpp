#pragma once
/// \file
/// Moved: this header is now <paratrain/strategy/buckets/gradient_buckets.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/strategy/buckets/gradient_buckets.hpp

#include "paratrain/strategy/buckets/gradient_buckets.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/gradient_buckets.hpp> moved to <paratrain/strategy/buckets/gradient_buckets.hpp>; the old path goes in the next release")
#endif
