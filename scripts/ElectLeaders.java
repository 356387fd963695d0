// Preferred leader election on every partition of a cluster (what kafka-leader-election.sh
// --election-type preferred --all-topic-partitions does), for `scripts/services
// cluster-elect`: after a fault the returning broker leads nothing until Kafka's own
// imbalance check, five minutes later; the broker-fault tests restore the leaders at once.
// Run as a single-file program: java -cp "$KAFKA_LIBS/*" ElectLeaders.java BOOTSTRAP
import java.util.Map;
import java.util.Optional;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.common.ElectionType;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.ElectionNotNeededException;

public class ElectLeaders {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        try (Admin admin = Admin.create(props)) {
            Map<TopicPartition, Optional<Throwable>> result =
                admin.electLeaders(ElectionType.PREFERRED, null).partitions().get();
            int moved = 0;
            for (Map.Entry<TopicPartition, Optional<Throwable>> e : result.entrySet()) {
                Optional<Throwable> error = e.getValue();
                if (error.isEmpty()) {
                    moved++;
                } else if (!(error.get() instanceof ElectionNotNeededException)) {
                    System.err.println(e.getKey() + ": " + error.get());
                }
            }
            System.out.println(moved + " partitions moved to their preferred leader");
        }
    }
}
