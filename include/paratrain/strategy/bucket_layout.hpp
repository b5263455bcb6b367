#pragma once
/// \file
/// Moved: this header is now <paratrain/strategy/buckets/bucket_layout.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/strategy/buckets/bucket_layout.hpp

#include "paratrain/strategy/buckets/bucket_layout.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/bucket_layout.hpp> moved to <paratrain/strategy/buckets/bucket_layout.hpp>; the old path goes in the next release")
#endif
