#pragma once
/// \file
/// paratrain::pipeline::detail::Link — activations and gradients between pipeline
/// stages: non-blocking sends, receives that check what arrives.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"

namespace paratrain::pipeline::detail {

// Note [Stage messages]
// A stage's output is one tensor or several (a tuple), whose shapes the receiving stage
// cannot know beforehand (the last micro-batch is smaller; a stage may change shapes).
// So every activation message is a fixed-size header first, then one payload per tensor:
// the header names the count, and each tensor's dtype, shape and whether it needs a
// gradient. The receiver allocates from it, so a shape or dtype the next stage does not
// expect is the next stage's clear error (its forward, or the checks below), never a
// receive that waits for bytes that do not come. Gradients need no header: they are shaped
// like the outputs whose gradients they are, which their receiver holds (send_known,
// recv_like), and a payload of another size is the communicator's length error. Sends are non-blocking (the sender goes on computing) and
// are completed as later sends and receives make progress; receives block, since the
// action that needs the data cannot start without it. Tags carry the message's kind,
// stage and micro-batch, so over MPI and Gloo the order of arrival does not matter (over
// NCCL, which has no tags: Note [One group per direction]).

inline constexpr std::int64_t header_words = 64;
inline constexpr std::int64_t header_magic = 0x50495045;  // "PIPE"

/// What a message is: tags are unique per (kind, stage, micro-batch) within a step.
enum class Message : int { activation = 0, gradient = 1, evaluation = 2 };

inline int tag_of(Message kind, int stage, int micro, int stages) {
  // The payloads go on tag + 1. MPI guarantees tags up to 32767: (kind, stage) pairs take
  // 3 * stages slots, each with a window of micro-batches; beyond the window micro-batch
  // numbers repeat, which is safe since the messages of one (kind, stage) between two ranks
  // are sent and received in the same micro-batch order.
  const int window = std::max(1, 16384 / (3 * stages));
  return ((static_cast<int>(kind) * stages + stage) * window + micro % window) * 2;
}

/// Whether `Comm`'s sends complete only once the peer has posted the receive (comm::Nccl),
/// where comm::Mpi and comm::Gloo buffer them.
template <class Comm>
constexpr bool unbuffered_sends() {
  if constexpr (requires { Comm::device_buffers_only; }) return Comm::device_buffers_only;
  else return false;
}

// Note [One group per direction]
// Over MPI or Gloo a send is buffered: the sender goes on, and tags match each receive to its
// message whatever the order. Over NCCL a send waits, on the communicator's stream, until the
// peer posts the matching receive, and a pair's messages match in the order they are posted
// (Note [NCCL point-to-point]). In 1F1B a stage sends activation i + 1 downstream before it
// receives gradient i from there, while the next stage sends gradient i before it receives
// activation i + 1: on one stream each send would wait for a receive queued behind the
// other's send. So over such a communicator activations (and evaluation outputs) travel on
// the pipeline group and gradients on a second group of the same ranks, each with its own
// stream: each direction is a chain (stage 0 to K - 1, or back), whose messages both sides
// post in micro-batch order, and a chain cannot wait on itself. Interleaved 1F1B sends
// around a ring, where no such order exists: it is refused over these communicators.

template <class Comm>
class Link {
  using Request = decltype(std::declval<Comm&>().isend(std::declval<const at::Tensor&>(), 0, 0));

 public:
  /// `device`: where this rank's stages live. The headers travel on the host, or on that
  /// device where the communicator takes device buffers only (comm::Nccl).
  /// `forward` carries activations and evaluation outputs, `backward` gradients: the same
  /// group, or two (Note [One group per direction]).
  Link(Comm& forward, Comm& backward, at::Device device)
      : comm_(&forward), back_(&backward), headers_(unbuffered_sends<Comm>() ? device : at::Device(at::kCPU)) {}

  /// Sends `tensors` to `peer`; `needs_grad[i]` says whether the receiver should make
  /// tensor i a leaf that requires a gradient. Non-blocking: the tensors are kept alive
  /// until sent.
  void send(const std::vector<at::Tensor>& tensors, const std::vector<bool>& needs_grad, int peer, int tag) {
    auto header = at::zeros({header_words}, at::kLong);
    auto* h = header.data_ptr<std::int64_t>();
    std::int64_t at = 0;
    h[at++] = header_magic;
    h[at++] = static_cast<std::int64_t>(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      if (at + 3 + t.dim() > header_words)
        throw error("pipeline::send", comm_->rank(),
                    "a stage's output has too many tensors or dimensions to describe in one message (" +
                        std::to_string(tensors.size()) + " tensors); return fewer from the stage's forward");
      h[at++] = static_cast<std::int64_t>(t.scalar_type());
      h[at++] = needs_grad[i] ? 1 : 0;
      h[at++] = t.dim();
      for (auto d : t.sizes()) h[at++] = d;
    }
    progress();
    if (headers_ != header.device()) header = header.to(headers_);
    pending_.push_back(comm_->isend(header, peer, tag));
    for (const auto& t : tensors) {
      auto payload = t.detach().contiguous();
      if (payload.numel() > 0) pending_.push_back(comm_->isend(payload, peer, tag + 1));
    }
  }

  /// Sends tensors whose count, dtypes and shapes the receiver knows (a stage's gradients,
  /// shaped like the outputs it sent): the payloads only, for recv_like.
  void send_known(const std::vector<at::Tensor>& tensors, int peer, int tag) {
    progress();
    for (const auto& t : tensors) {
      auto payload = t.detach().contiguous();
      if (payload.numel() > 0) pending_.push_back(back_->isend(payload, peer, tag + 1));
    }
  }

  /// Receives what send_known sent: tensors shaped like `like`, on their devices. A payload
  /// of another size is the communicator's error (comm::Mpi and comm::Gloo check lengths).
  std::vector<at::Tensor> recv_like(const std::vector<at::Tensor>& like, int peer, int tag) {
    progress();
    std::vector<at::Tensor> out;
    for (const auto& l : like) {
      auto t = at::empty(l.sizes(), l.options());
      if (t.numel() > 0) back_->recv(t, peer, tag + 1);
      out.push_back(std::move(t));
    }
    return out;
  }

  /// Receives what `peer` sent with `tag`: the tensors, and which need a gradient.
  std::pair<std::vector<at::Tensor>, std::vector<bool>> recv(int peer, int tag, at::Device device) {
    progress();
    auto header = at::empty({header_words}, at::TensorOptions(at::kLong).device(headers_));
    comm_->recv(header, peer, tag);
    if (!header.is_cpu()) header = header.cpu();
    const auto* h = header.data_ptr<std::int64_t>();
    if (h[0] != header_magic || h[1] < 0 || h[1] > header_words)
      throw error("pipeline::recv", comm_->rank(),
                  "rank " + std::to_string(peer) + " sent something that is not a stage message (tag " +
                      std::to_string(tag) + "): every rank must run the same pipeline");
    std::pair<std::vector<at::Tensor>, std::vector<bool>> out;
    std::int64_t at = 2;
    for (std::int64_t i = 0; i < h[1]; ++i) {
      const auto dtype = static_cast<at::ScalarType>(h[at++]);
      const bool needs_grad = h[at++] != 0;
      const auto dims = h[at++];
      std::vector<std::int64_t> shape(h + at, h + at + dims);
      at += dims;
      auto t = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
      if (t.numel() > 0) comm_->recv(t, peer, tag + 1);
      out.first.push_back(std::move(t));
      out.second.push_back(needs_grad);
    }
    return out;
  }

  /// Completes the sends that have gone: MPI progresses only inside its calls. A request
  /// whose test() would wait for the receiver says so with `pollable()` false (comm::Gloo's
  /// sends, which progress on c10d's threads): testing it here would make two ranks that
  /// send to each other wait for each other, so it is left for flush().
  void progress() {
    for (auto it = pending_.begin(); it != pending_.end();)
      it = pollable(*it) && it->test() ? pending_.erase(it) : std::next(it);
  }

  static bool pollable(const Request& r) {
    if constexpr (requires { r.pollable(); }) return r.pollable();
    else return true;
  }

  /// Waits for every send to complete.
  void flush() {
    for (auto& r : pending_) r.wait();
    pending_.clear();
  }

 private:
  Comm* comm_;
  Comm* back_;
  at::Device headers_;
  std::list<Request> pending_;
};

}  // namespace paratrain::pipeline::detail
