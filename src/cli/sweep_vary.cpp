// hpmoe sweep's --vary: a machine model's fields set or scaled before it is
// read (its own file: the fuzz target of this parser links it alone).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <nlohmann/json.hpp>

#include "cli/sweep.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe {
namespace {

using nlohmann::json;

// A --vary value: a finite number, or xF (the model's value times F).
// Returns (F or the number, whether it scales).
std::pair<double, bool> vary_value(const std::string& value, const std::string& whole) {
  double v = 0;
  std::size_t used = 0;
  const bool scale = !value.empty() && value[0] == 'x';
  try {
    v = std::stod(value.substr(scale ? 1 : 0), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() - (scale ? 1 : 0) || !std::isfinite(v))
    throw Error("--vary " + whole + "=" + value + ": a value is a finite number, or xF (the model's value times F)");
  return {v, scale};
}

// Sets `path` (dotted; "*" every element of an array) in `j` to `value`
// ("xF": the value there times F). Error naming the path where it does not
// lead to a number.
void set_field(json& j, const std::string& path, std::size_t from, const std::string& value, const std::string& whole) {
  const std::size_t dot = path.find('.', from);
  const std::string key = path.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
  const bool last = dot == std::string::npos;
  const auto apply = [&](json& target) {
    if (!last) return set_field(target, path, dot + 1, value, whole);
    if (!target.is_number())
      throw Error("--vary " + whole + ": the machine model's '" + whole + "' is not a number (it is " + target.type_name() + ")");
    const auto [v, scale] = vary_value(value, whole);
    const double result = scale ? target.get<double>() * v : v;
    if (!std::isfinite(result))
      throw Error("--vary " + whole + "=" + value + ": the model's value times " + value.substr(1) + " is not finite");
    // An integer field stays an integer where the value is one it can hold
    // (1e308 used to become -9223372036854775808).
    constexpr double kInt64Limit = 9223372036854775808.0;  // 2^63
    if (target.is_number_integer() && !scale && result == std::floor(result) && std::abs(result) < kInt64Limit)
      target = static_cast<std::int64_t>(result);
    else target = result;
  };
  if (key == "*") {
    if (!j.is_array()) throw Error("--vary " + whole + ": '*' stands for the elements of an array, and there is none there");
    for (auto& e : j) apply(e);
    return;
  }
  if (!j.is_object() || !j.contains(key))
    throw Error("--vary " + whole + ": the machine model has no field '" + key + "' there (see its file in machines/)");
  apply(j[key]);
}

}  // namespace

std::pair<std::string, std::vector<std::string>> parse_vary(const std::string& spec) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) throw Error("--vary expects PATH=V1,V2,..., got '" + spec + "'");
  std::vector<std::string> values;
  std::stringstream list(spec.substr(eq + 1));
  for (std::string v; std::getline(list, v, ',');) {
    if (v.empty()) throw Error("--vary " + spec + ": an empty value");
    (void)vary_value(v, spec.substr(0, eq));  // refused here, not in its result row
    values.push_back(v);
  }
  if (values.empty() || spec.back() == ',') throw Error("--vary " + spec + ": an empty value");
  return {spec.substr(0, eq), std::move(values)};
}

std::vector<std::string> vary_fields(const std::string& paths) {
  std::vector<std::string> fields;
  for (std::size_t from = 0; from <= paths.size();) {
    const std::size_t plus = std::min(paths.find('+', from), paths.size());
    fields.push_back(paths.substr(from, plus - from));
    from = plus + 1;
  }
  return fields;
}

nlohmann::json vary_machine_json(nlohmann::json model, const std::vector<std::pair<std::string, std::vector<std::string>>>& vary,
                                 const std::vector<std::string>& values) {
  if (values.size() != vary.size()) throw Error("--vary: one value per varied field");
  for (std::size_t i = 0; i < vary.size(); ++i) {
    // "A+B": fields varied together (one figure the model gives in two places).
    const std::string& paths = vary[i].first;
    for (const std::string& path : vary_fields(paths)) {
      if (path.empty()) throw Error("--vary " + paths + ": an empty field path");
      set_field(model, path, 0, values[i], path);
    }
  }
  return model;
}

sim::MachineModel varied_machine(const std::string& machine, const std::vector<std::pair<std::string, std::vector<std::string>>>& vary,
                                 const std::vector<std::string>& values) {
  if (vary.empty()) return sim::load_machine(machine);
  std::string path;
  const json j = vary_machine_json(sim::load_machine_json(machine, &path), vary, values);
  try {
    return sim::machine_from_json(j);
  } catch (const Error& e) {
    std::string given;
    for (std::size_t i = 0; i < vary.size(); ++i) given += " " + vary[i].first + "=" + values[i];
    throw Error(std::string(e.what()) + " (in " + path + " with" + given + ")");
  }
}

}  // namespace hpmoe
