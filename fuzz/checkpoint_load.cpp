// Fuzzes checkpoint::load, the reader of a checkpoint's index, chunk tables and data: the
// files a crash, a full disk or a hostile hand leaves behind. Whatever the bytes, load must
// return or throw paratrain::error naming a file of the checkpoint, and touch no memory
// it does not own (AddressSanitizer, UndefinedBehaviorSanitizer).
//
// A checkpoint's .pt files are zip archives whose entries carry CRC-32s, so mutated bytes
// rarely get past the archive to paratrain's own checks. The input is therefore read in
// one of two ways, chosen by its first byte:
//   even: edits to a genuine checkpoint (Adam, two tensors, written at start-up): each
//         edit replaces or removes one value of the index's or the rank file's dict tree
//         by a value of another type, another number or a string; the rank file's size
//         and CRC-32C in the index are then refreshed, so the edited tables are read;
//   odd:  raw bytes, split at "\0PTFZ\0" into index.pt, rank-00000.pt and rank-00000.bin.
// Built with clang's libFuzzer (fuzz/CMakeLists.txt, scripts/fuzz.sh), and with g++ as a
// ctest that replays fuzz/corpus/checkpoint_load (replay_main.cpp).
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/util/crc32c.hpp"
#include "paratrain/strategy/data_parallel.hpp"

namespace {

namespace fs = std::filesystem;
namespace ckpt = paratrain::checkpoint;
using Strategy = paratrain::DataParallel<torch::nn::Linear, paratrain::comm::SingleDevice, torch::optim::Adam>;

// The bytes an input is read from, front to back; zeros once they run out.
struct Bytes {
  const std::uint8_t* at;
  std::size_t left;
  std::uint8_t byte() {
    if (left == 0) return 0;
    --left;
    return *at++;
  }
  std::int64_t number() {
    // Mostly small numbers and edges, which reach the range checks; sometimes any 64 bits.
    switch (byte() % 8) {
      case 0: return -1;
      case 1: return std::numeric_limits<std::int64_t>::max();
      case 2: return std::numeric_limits<std::int64_t>::min();
      case 3: {
        std::uint64_t v = 0;
        for (int i = 0; i < 8; ++i) v = v << 8 | byte();
        return static_cast<std::int64_t>(v);
      }
      default: return static_cast<std::int64_t>(byte()) - 16;
    }
  }
};

std::vector<char> read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_all(const fs::path& p, std::string_view bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

c10::IValue deep_copy(const c10::IValue& v) {
  if (v.isGenericDict()) {
    auto out = ckpt::make_dict();
    for (const auto& e : v.toGenericDict()) out.insert(e.key(), deep_copy(e.value()));
    return out;
  }
  if (v.isList()) {
    c10::impl::GenericList out(v.toList().elementType());
    for (const auto& e : v.toList()) out.push_back(deep_copy(e));
    return out;
  }
  return v;
}

// Every place a value sits in a dict tree: a dict and key, or a list and index.
struct Slot {
  c10::IValue container;
  c10::IValue key;  // a dict's key; for a list, the index as an int
};

void slots_of(const c10::IValue& v, std::vector<Slot>& out) {
  if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      out.push_back({v, e.key()});
      slots_of(e.value(), out);
    }
  } else if (v.isList()) {
    const auto list = v.toList();
    for (std::size_t i = 0; i < list.size(); ++i) {
      out.push_back({v, static_cast<std::int64_t>(i)});
      slots_of(list.get(i), out);
    }
  }
}

c10::IValue replacement(Bytes& in) {
  switch (in.byte() % 8) {
    case 0: return in.number();
    case 1: return std::string(in.byte() % 24, static_cast<char>('a' + in.byte() % 26));
    case 2: return static_cast<double>(in.number()) / 3.0;
    case 3: return c10::IValue();
    case 4: return static_cast<bool>(in.byte() & 1);
    case 5: return ckpt::make_dict();
    case 6: return c10::List<std::int64_t>({in.number(), in.number()});
    default: return c10::impl::GenericList(c10::AnyType::get());
  }
}

void edit(c10::IValue& root, Bytes& in) {
  std::vector<Slot> slots;
  slots_of(root, slots);
  if (slots.empty()) return;
  auto& s = slots[(static_cast<std::size_t>(in.byte()) << 8 | in.byte()) % slots.size()];
  const bool remove = in.byte() % 6 == 0;
  if (s.container.isGenericDict()) {
    auto d = s.container.toGenericDict();
    if (remove) (void)d.erase(s.key);
    else d.insert_or_assign(s.key, replacement(in));
  } else {
    auto l = s.container.toList();
    const auto i = static_cast<std::size_t>(s.key.toInt());
    if (remove) l.erase(l.begin() + static_cast<std::ptrdiff_t>(i));
    else if (l.elementType()->kind() == c10::TypeKind::AnyType) l.set(i, replacement(in));
    else if (l.elementType()->kind() == c10::TypeKind::IntType) l.set(i, in.number());
  }
}

struct Fixture {
  fs::path dir;  // where inputs become files
  Strategy strategy{torch::nn::Linear(3, 2), torch::optim::AdamOptions(1e-2)};
  c10::IValue index, meta;
  std::vector<char> data;

  Fixture() {
    char name[] = "/tmp/paratrain-fuzz-XXXXXX";
    if (mkdtemp(name) == nullptr) std::abort();
    dir = name;
    // A genuine checkpoint after one step, so that Adam has state.
    const paratrain::Batch b{torch::randn({4, 3}), torch::randn({4, 2})};
    strategy.step(b, [](const at::Tensor& y, const at::Tensor& t) { return (y - t).square().mean(); });
    ckpt::save(strategy, dir / "genuine", 1);
    const auto saved = ckpt::path_of(dir / "genuine", 1);
    index = ckpt::detail::read_dict("index", read_all(saved / "index.pt"));
    meta = ckpt::detail::read_dict("meta", read_all(saved / "rank-00000.pt"));
    data = read_all(saved / "rank-00000.bin");
    fs::create_directories(dir / "input");
    // PARATRAIN_FUZZ_WRITE_SEED=<file>: the genuine checkpoint as a raw-mode input (how the
    // corpus's raw seed was made).
    if (const char* seed = std::getenv("PARATRAIN_FUZZ_WRITE_SEED")) {
      std::string bytes(1, '\x01');
      for (const char* name : {"index.pt", "rank-00000.pt", "rank-00000.bin"}) {
        if (bytes.size() > 1) bytes.append("\0PTFZ\0", 6);
        const auto b = read_all(saved / name);
        bytes.append(b.data(), b.size());
      }
      write_all(seed, bytes);
    }
  }
  ~Fixture() { fs::remove_all(dir); }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

std::string pickled(const c10::IValue& v) {
  const auto bytes = torch::pickle_save(v);
  return {bytes.begin(), bytes.end()};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto& f = fixture();
  const auto in_dir = f.dir / "input";
  Bytes in{data, size};
  if (in.byte() % 2 == 0) {
    auto index = deep_copy(f.index), meta = deep_copy(f.meta);
    const int edits = 1 + in.byte() % 4;
    for (int e = 0; e < edits; ++e) edit(in.byte() % 3 == 0 ? index : meta, in);
    const auto meta_bytes = pickled(meta);
    // The index's record of the rank file, refreshed where the edits left it a dict.
    if (index.isGenericDict()) {
      const auto d = index.toGenericDict();
      if (d.contains("ranks") && d.at("ranks").isList() && !d.at("ranks").toList().empty() &&
          d.at("ranks").toList().get(0).isGenericDict()) {
        auto r = d.at("ranks").toList().get(0).toGenericDict();
        if (r.contains("meta_bytes")) r.insert_or_assign("meta_bytes", static_cast<std::int64_t>(meta_bytes.size()));
        if (r.contains("meta_crc32c"))
          r.insert_or_assign("meta_crc32c", static_cast<std::int64_t>(paratrain::detail::crc32c_extend(
                                                0, meta_bytes.data(), meta_bytes.size())));
      }
    }
    write_all(in_dir / "index.pt", pickled(index));
    write_all(in_dir / "rank-00000.pt", meta_bytes);
    write_all(in_dir / "rank-00000.bin", std::string_view(f.data.data(), f.data.size()));
  } else {
    const std::string_view rest(reinterpret_cast<const char*>(in.at), in.left);
    constexpr std::string_view separator("\0PTFZ\0", 6);
    std::size_t from = 0;
    for (const char* name : {"index.pt", "rank-00000.pt", "rank-00000.bin"}) {
      const auto to = std::min(rest.find(separator, from), rest.size());
      if (from <= rest.size()) write_all(in_dir / name, rest.substr(from, to - from));
      else fs::remove(in_dir / name);
      from = to + separator.size();
    }
  }
  try {
    ckpt::load(f.strategy, in_dir);
  } catch (const paratrain::error& e) {
    // A clear error names the checkpoint or one of its files.
    if (std::string_view(e.what()).find(in_dir.string()) == std::string_view::npos) {
      std::fprintf(stderr, "checkpoint_load: an error that names no file: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
