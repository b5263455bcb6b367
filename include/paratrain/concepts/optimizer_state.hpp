#pragma once
/// \file
/// paratrain::optimizer_schema — what a checkpoint keeps of an optimizer, and what ZeRO
/// counts of it: each parameter's state tensors and step, and each parameter group's
/// options, by the names PyTorch's state_dict uses. Below the strategies and checkpoints,
/// which both read it (paratrain::checkpoint names the same templates).

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <stdexcept>
#include <utility>
#include <vector>

namespace paratrain {

/// A string-keyed dictionary of IValues: what `torch.load` gives in Python as a dict.
using Dict = c10::impl::GenericDict;
inline Dict make_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

/// A parameter's state, field by field ("exp_avg", ...), and its step count.
struct ParamStateTensors {
  std::map<std::string, at::Tensor> tensors;
  std::optional<std::int64_t> step;
};

/// How a checkpoint reads and writes the state of optimizer `O`: specialised for
/// torch::optim's SGD, Adam, AdamW, Adagrad and RMSprop (and types derived from them:
/// see schema_of), whose per-element state ZeRO shards as well (Note [Optimizer on
/// pieces]). Members: `name`; `fields` (state tensors, PyTorch's names); `get(state)`;
/// `make(ParamStateTensors)`; `options(const OptimizerOptions&) -> Dict`;
/// `set_options(OptimizerOptions&, const Dict&)`.
template <class O>
struct optimizer_schema;

namespace detail {

// Typed reads of a group's saved options; a missing or mistyped entry is a clear error.
inline const c10::IValue& option(const Dict& d, const char* key, bool ok(const c10::IValue&), const char* what) {
  const auto it = d.find(key);
  if (it == d.end() || !ok(it->value()))
    throw std::invalid_argument(std::string("option '") + key + "' is missing or not " + what);
  return it->value();
}
inline double number(const Dict& d, const char* key) {
  const auto& v = option(d, key, [](const c10::IValue& v) { return v.isDouble() || v.isInt(); }, "a number");
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}
inline bool flag(const Dict& d, const char* key) {
  return option(d, key, [](const c10::IValue& v) { return v.isBool(); }, "true or false").toBool();
}
inline std::pair<double, double> number_pair(const Dict& d, const char* key) {
  const auto& v = option(
      d, key, [](const c10::IValue& v) { return v.isDoubleList() && v.toDoubleList().size() == 2; }, "two numbers");
  return {v.toDoubleList().get(0), v.toDoubleList().get(1)};
}

// The state types differ only in fields; each accessor pair is named once below.
template <class State, class Options>
struct SchemaBase {
  using state_type = State;
  using options_type = Options;
  static const Options& cast(const torch::optim::OptimizerOptions& o) { return static_cast<const Options&>(o); }
  static Options& cast(torch::optim::OptimizerOptions& o) { return static_cast<Options&>(o); }
};

}  // namespace detail

template <>
struct optimizer_schema<torch::optim::SGD>
    : detail::SchemaBase<torch::optim::SGDParamState, torch::optim::SGDOptions> {
  static constexpr const char* name = "SGD";
  static constexpr const char* fields[] = {"momentum_buffer"};
  static ParamStateTensors get(const state_type& s) { return {{{"momentum_buffer", s.momentum_buffer()}}, {}}; }
  static std::unique_ptr<state_type> make(const ParamStateTensors& t) {
    auto s = std::make_unique<state_type>();
    if (auto it = t.tensors.find("momentum_buffer"); it != t.tensors.end()) s->momentum_buffer(it->second);
    return s;
  }
  static Dict options(const torch::optim::OptimizerOptions& base) {
    const auto& o = cast(base);
    auto d = make_dict();
    d.insert("lr", o.lr());
    d.insert("momentum", o.momentum());
    d.insert("dampening", o.dampening());
    d.insert("weight_decay", o.weight_decay());
    d.insert("nesterov", o.nesterov());
    return d;
  }
  static void set_options(torch::optim::OptimizerOptions& base, const Dict& d) {
    auto& o = cast(base);
    o.lr(detail::number(d, "lr")).momentum(detail::number(d, "momentum")).dampening(detail::number(d, "dampening"));
    o.weight_decay(detail::number(d, "weight_decay")).nesterov(detail::flag(d, "nesterov"));
  }
};

namespace detail {

// Adam and AdamW have the same state and options, in different types.
template <class State, class Options, const char* Name>
struct AdamSchema : SchemaBase<State, Options> {
  using Base = SchemaBase<State, Options>;
  static constexpr const char* name = Name;
  static constexpr const char* fields[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static ParamStateTensors get(const State& s) {
    return {{{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}, {"max_exp_avg_sq", s.max_exp_avg_sq()}},
            s.step()};
  }
  static std::unique_ptr<State> make(const ParamStateTensors& t) {
    auto s = std::make_unique<State>();
    s->step(t.step.value_or(0));
    if (auto it = t.tensors.find("exp_avg"); it != t.tensors.end()) s->exp_avg(it->second);
    if (auto it = t.tensors.find("exp_avg_sq"); it != t.tensors.end()) s->exp_avg_sq(it->second);
    if (auto it = t.tensors.find("max_exp_avg_sq"); it != t.tensors.end()) s->max_exp_avg_sq(it->second);
    return s;
  }
  static Dict options(const torch::optim::OptimizerOptions& base) {
    const auto& o = Base::cast(base);
    auto d = make_dict();
    d.insert("lr", o.lr());
    d.insert("betas", c10::List<double>({std::get<0>(o.betas()), std::get<1>(o.betas())}));
    d.insert("eps", o.eps());
    d.insert("weight_decay", o.weight_decay());
    d.insert("amsgrad", o.amsgrad());
    return d;
  }
  static void set_options(torch::optim::OptimizerOptions& base, const Dict& d) {
    auto& o = Base::cast(base);
    const auto [beta1, beta2] = number_pair(d, "betas");
    o.lr(number(d, "lr")).betas({beta1, beta2}).eps(number(d, "eps"));
    o.weight_decay(number(d, "weight_decay")).amsgrad(flag(d, "amsgrad"));
  }
};
inline constexpr char adam_name[] = "Adam";
inline constexpr char adamw_name[] = "AdamW";

}  // namespace detail

template <>
struct optimizer_schema<torch::optim::Adam>
    : detail::AdamSchema<torch::optim::AdamParamState, torch::optim::AdamOptions, detail::adam_name> {};
template <>
struct optimizer_schema<torch::optim::AdamW>
    : detail::AdamSchema<torch::optim::AdamWParamState, torch::optim::AdamWOptions, detail::adamw_name> {};

template <>
struct optimizer_schema<torch::optim::Adagrad>
    : detail::SchemaBase<torch::optim::AdagradParamState, torch::optim::AdagradOptions> {
  static constexpr const char* name = "Adagrad";
  static constexpr const char* fields[] = {"sum"};
  static ParamStateTensors get(const state_type& s) { return {{{"sum", s.sum()}}, s.step()}; }
  static std::unique_ptr<state_type> make(const ParamStateTensors& t) {
    auto s = std::make_unique<state_type>();
    s->step(t.step.value_or(0));
    if (auto it = t.tensors.find("sum"); it != t.tensors.end()) s->sum(it->second);
    return s;
  }
  static Dict options(const torch::optim::OptimizerOptions& base) {
    const auto& o = cast(base);
    auto d = make_dict();
    d.insert("lr", o.lr());
    d.insert("lr_decay", o.lr_decay());
    d.insert("weight_decay", o.weight_decay());
    d.insert("initial_accumulator_value", o.initial_accumulator_value());
    d.insert("eps", o.eps());
    return d;
  }
  static void set_options(torch::optim::OptimizerOptions& base, const Dict& d) {
    auto& o = cast(base);
    o.lr(detail::number(d, "lr")).lr_decay(detail::number(d, "lr_decay"));
    o.weight_decay(detail::number(d, "weight_decay"));
    o.initial_accumulator_value(detail::number(d, "initial_accumulator_value")).eps(detail::number(d, "eps"));
  }
};

template <>
struct optimizer_schema<torch::optim::RMSprop>
    : detail::SchemaBase<torch::optim::RMSpropParamState, torch::optim::RMSpropOptions> {
  static constexpr const char* name = "RMSprop";
  static constexpr const char* fields[] = {"square_avg", "momentum_buffer", "grad_avg"};
  static ParamStateTensors get(const state_type& s) {
    return {{{"square_avg", s.square_avg()}, {"momentum_buffer", s.momentum_buffer()}, {"grad_avg", s.grad_avg()}},
            s.step()};
  }
  static std::unique_ptr<state_type> make(const ParamStateTensors& t) {
    auto s = std::make_unique<state_type>();
    s->step(t.step.value_or(0));
    if (auto it = t.tensors.find("square_avg"); it != t.tensors.end()) s->square_avg(it->second);
    if (auto it = t.tensors.find("momentum_buffer"); it != t.tensors.end()) s->momentum_buffer(it->second);
    if (auto it = t.tensors.find("grad_avg"); it != t.tensors.end()) s->grad_avg(it->second);
    return s;
  }
  static Dict options(const torch::optim::OptimizerOptions& base) {
    const auto& o = cast(base);
    auto d = make_dict();
    d.insert("lr", o.lr());
    d.insert("alpha", o.alpha());
    d.insert("eps", o.eps());
    d.insert("weight_decay", o.weight_decay());
    d.insert("momentum", o.momentum());
    d.insert("centered", o.centered());
    return d;
  }
  static void set_options(torch::optim::OptimizerOptions& base, const Dict& d) {
    auto& o = cast(base);
    o.lr(detail::number(d, "lr")).alpha(detail::number(d, "alpha")).eps(detail::number(d, "eps"));
    o.weight_decay(detail::number(d, "weight_decay")).momentum(detail::number(d, "momentum"));
    o.centered(detail::flag(d, "centered"));
  }
};

/// The schema of `O`: its own, or that of the torch::optim optimizer it derives from.
template <class O>
using schema_of = optimizer_schema<std::conditional_t<
    std::derived_from<O, torch::optim::AdamW>, torch::optim::AdamW,
    std::conditional_t<std::derived_from<O, torch::optim::Adam>, torch::optim::Adam,
                       std::conditional_t<std::derived_from<O, torch::optim::SGD>, torch::optim::SGD,
                                          std::conditional_t<std::derived_from<O, torch::optim::Adagrad>,
                                                             torch::optim::Adagrad, torch::optim::RMSprop>>>>>;

/// Whether checkpoints know the state of optimizer `O`.
template <class O>
concept known_optimizer = std::derived_from<O, torch::optim::SGD> || std::derived_from<O, torch::optim::Adam> ||
                          std::derived_from<O, torch::optim::AdamW> || std::derived_from<O, torch::optim::Adagrad> ||
                          std::derived_from<O, torch::optim::RMSprop>;

}  // namespace paratrain
