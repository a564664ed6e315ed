#include "common/json_parse.hpp"

#include <filesystem>
#include <fstream>
#include <istream>

#include "common/input_file.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe {

namespace {

template <class Input>
nlohmann::json parse_with_limits(Input&& in, const std::string& what, bool ignore_comments) {
  const auto depth_limit = [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    if (depth > kMaxJsonDepth)
      throw Error(what + " nests deeper than " + std::to_string(kMaxJsonDepth) + " levels, which no hpmoe input does");
    return true;
  };
  try {
    return nlohmann::json::parse(std::forward<Input>(in), depth_limit, true, ignore_comments);
  } catch (const Error&) {
    throw;
  } catch (const nlohmann::json::exception& e) {
    throw Error(what + " is not valid JSON: " + e.what());
  } catch (const std::exception& e) {  // a directory given as a file, a read error
    throw Error(what + " could not be read: " + e.what());
  }
}

}  // namespace

nlohmann::json parse_json(std::istream& in, const std::string& what, bool ignore_comments) {
  return parse_with_limits(in, what, ignore_comments);
}

nlohmann::json parse_json(const std::string& text, const std::string& what, bool ignore_comments) {
  return parse_with_limits(text, what, ignore_comments);
}

nlohmann::json parse_json_file(const std::string& path, const std::string& what, const std::string& open_error) {
  struct stat st {};
  if (!open_error.empty() && ::stat(path.c_str(), &st) != 0) throw Error(open_error);
  std::ifstream in = open_input(path, what);
  return parse_with_limits(in, what, false);
}

}  // namespace hpmoe
