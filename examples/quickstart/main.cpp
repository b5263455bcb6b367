// The README's program: one alias chooses the strategy; `ctest -L quickstart` builds and runs
// it once per row of the README's table (examples/quickstart/aliases.txt), nothing else changed.
#include <paratrain/paratrain.hpp>
#include <torch/torch.h>

struct FeaturesImpl : torch::nn::Cloneable<FeaturesImpl> {  // stage 1; Cloneable: DP copies it
  paratrain::Unit<torch::nn::Linear> fc{nullptr};           // a Unit: ZeRO-3 gathers it when used
  FeaturesImpl() { reset(); }
  void reset() override { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(784, 256)); }
  torch::Tensor forward(torch::Tensor x) { return torch::relu(fc(x.flatten(1))); }
};
TORCH_MODULE(Features);
struct ClassifierImpl : torch::nn::Cloneable<ClassifierImpl> {  // stage 2
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
  ClassifierImpl() { reset(); }
  void reset() override { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(256, 10)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
};
TORCH_MODULE(Classifier);
using Net = paratrain::Chain<Features, Classifier>;  // the stages in order, as one model

using Strategy = paratrain::DataParallel<Net, paratrain::comm::Mpi, torch::optim::Adam>;  // DDP over MPI

int main(int argc, char** argv) {
  return paratrain::main(argc, argv, [] {
    const std::string dir = "/usr/share/datasets/fashion-mnist/";  // Debian's dataset-fashion-mnist
    const paratrain::data::IdxDataset train(dir + "train-images-idx3-ubyte.gz", dir + "train-labels-idx1-ubyte.gz"),
        test(dir + "t10k-images-idx3-ubyte.gz", dir + "t10k-labels-idx1-ubyte.gz");
    Strategy strategy(torch::optim::AdamOptions(1e-3));
    paratrain::fit(strategy, train, {.epochs = 1, .batch_size = 64, .eval = &test});
  });
}
