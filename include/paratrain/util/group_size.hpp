#pragma once
/// \file
/// The number of ranks of a strategy (world_size()) or a communicator (size()).

namespace paratrain::detail {

template <class Group>
int group_size(Group& g) {
  if constexpr (requires { g.world_size(); }) return g.world_size();
  else return g.size();
}

}  // namespace paratrain::detail
