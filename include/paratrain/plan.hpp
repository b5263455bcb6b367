#pragma once
/// \file
/// Moved: this header is now <paratrain/plan/plan.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/plan/plan.hpp

#include "paratrain/plan/plan.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/plan.hpp> moved to <paratrain/plan/plan.hpp>; the old path goes in the next release")
#endif
