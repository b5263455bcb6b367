#pragma once
/// \file
/// Moved: this header is now <paratrain/pipeline/pipeline.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/pipeline/pipeline.hpp

#include "paratrain/pipeline/pipeline.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/strategy/pipeline.hpp> moved to <paratrain/pipeline/pipeline.hpp>; the old path goes in the next release")
#endif
