pub use gradsync_runtime::*;
