// The membership store's client (part of the `_collectives` module:
// collectives.cpp): the store of an elastic job, as the runtime's membership
// protocol and its liveness monitor use it (python/src/membership.rs), from
// threads of their own and without the interpreter lock. Keys and values are
// bytes. Also the cancellation of broken membership epochs.

#include "shim.h"

namespace gradsync::shim {

namespace {

std::string key_of(const char* key, size_t key_len) { return std::string(key, key_len); }

// Copies `value` into `out` (capacity `cap`); `*len` is its full length (the
// caller retries with a larger buffer when it exceeds `cap`).
void copy_out(const std::vector<uint8_t>& value, uint8_t* out, size_t cap, size_t* len) {
  *len = value.size();
  if (value.size() <= cap && !value.empty()) {
    std::memcpy(out, value.data(), value.size());
  }
}

}  // namespace

int32_t store_add(void* client, const char* key, size_t key_len, int64_t delta, int64_t* out, char* err,
                  size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] { *out = c->store->add(key_of(key, key_len), delta); });
}

int32_t store_set(void* client, const char* key, size_t key_len, const uint8_t* value, size_t len, char* err,
                  size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] { c->store->set(key_of(key, key_len), std::vector<uint8_t>(value, value + len)); });
}

// `*found` says whether `key` exists; if it does, its value is copied out. Never blocks for a missing key.
int32_t store_get(void* client, const char* key, size_t key_len, int32_t* found, uint8_t* out, size_t cap,
                  size_t* len, char* err, size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  *found = 0;
  *len = 0;
  return guarded(err, err_len, [&] {
    std::string k = key_of(key, key_len);
    if (c->store->check({k})) {
      *found = 1;
      copy_out(c->store->get(k), out, cap, len);
    }
  });
}

// Sets `key` to `desired` if it holds `expected` (or is absent and `expected`
// is empty); copies out the value it holds afterwards (the winner's).
int32_t store_compare_set(void* client, const char* key, size_t key_len, const uint8_t* expected, size_t expected_len,
                          const uint8_t* desired, size_t desired_len, uint8_t* out, size_t cap, size_t* len,
                          char* err, size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] {
    auto now = c->store->compareSet(key_of(key, key_len), std::vector<uint8_t>(expected, expected + expected_len),
                                    std::vector<uint8_t>(desired, desired + desired_len));
    copy_out(now, out, cap, len);
  });
}

// Every wait of an endpoint of membership epoch <= `epoch` fails from now on.
void cancel_epoch(void* cancel, int64_t epoch) {
  auto* c = static_cast<Cancel*>(cancel);
  int64_t seen = c->broken.load();
  while (seen < epoch && !c->broken.compare_exchange_weak(seen, epoch)) {
  }
}


}  // namespace gradsync::shim
